"""tests.support"""
