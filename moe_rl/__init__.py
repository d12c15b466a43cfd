"""moe-rl: a research testbed for reinforcement learning of Mixture-of-Experts language models."""

__version__ = "0.1.0"
