"""tests.store"""
