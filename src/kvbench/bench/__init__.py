"""What bench measures: settings, engines, the sweeps, the floor, token agreement, environment probes."""
