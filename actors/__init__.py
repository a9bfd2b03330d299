"""actors"""
