"""Run folders: writing them as a run goes (results/report.py), reading them back (results/runs.py), comparing two (results/compare.py), and their plots."""
