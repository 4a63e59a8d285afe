"""Run folders, one job per module:

rundir       claiming a folder, writing into it atomically, and --export of its rows
report       what a bench run records as it goes: meta.json, summary.csv, steps.csv, ttft.csv, its plots
environment  the host facts meta.json records, and whether two runs are comparable
runs         a run folder read back and checked
stats        the statistics of a comparison: bootstrap intervals, Mann-Whitney U, verdicts, TTFT's per row
compare      two runs matched row by row, gated, and written as JSON
plots        every figure of bench and compare (matplotlib, imported here only)
junit        verify's and break's --junit-xml
"""
