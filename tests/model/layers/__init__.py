"""tests.model.layers"""
