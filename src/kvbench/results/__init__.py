"""Run folders: claiming one and writing into it (results/rundir.py), what a run records as it goes
(results/report.py), reading them back (results/runs.py), comparing two (results/compare.py, with results/stats.py
and results/environment.py), and their plots (results/plots.py)."""
