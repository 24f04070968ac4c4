"""tests.text"""
