"""threshold"""
