"""Emulated device time (`cluster.device=emulated`): the real rank code on stand-ins for the
device work, priced by the simulator's cost model. See `config.py`."""
