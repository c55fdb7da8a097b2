"""The outer RL loop, one module per trainer mode, plus metrics logging and plots."""
