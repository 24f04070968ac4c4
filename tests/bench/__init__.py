"""tests.bench"""
