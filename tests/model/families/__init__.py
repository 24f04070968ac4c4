"""tests.model.families"""
