"""treadle.server"""
