"""tests.server.api"""
