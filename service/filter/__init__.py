"""filter"""
