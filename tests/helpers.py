"""Helpers several test modules share (plain functions; fixtures live in conftest.py)."""
import torch

import train


def runs_of(*flags):
    """The runs train.py plans for a command line (train.plan), configs and folders included."""
    return train.plan(train.build_parser().parse_args(list(flags)))


def experiment(*flags, data=None, **config):
    """The Experiment train.py builds on the CPU for the command line's first run (its family's
    setup, as train.execute calls it; data: the run's own unless given; config: keys changed)."""
    run = runs_of(*flags)[0]
    run.config.update(config)
    data = train.load_data(run) if data is None else data
    return train.FAMILIES[run.family]["setup"](run, data, train.Place(torch.device("cpu"), 0, 1))
