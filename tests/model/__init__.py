"""tests.model"""
