"""The generation loop and its rules (generate.py), and the fixed-shape decode step (decode/fixed_step.py)."""
