"""per_instance"""
