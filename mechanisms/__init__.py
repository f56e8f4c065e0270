"""Pure numerics of the expost service: privacy accounting and DP mechanisms.

This package never imports ``service``; it is usable as a library on its own.
"""
