"""The wire's Structs by area; protocol/methods.py gathers them with the method table."""
