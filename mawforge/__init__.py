"""MawForge: run Mixture-of-Experts models larger than the memory they are given."""

__version__ = "0.1.0"
