"""tests.routing"""
