"""tests.server"""
