"""tests.engine"""
