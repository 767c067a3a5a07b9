"""flm: flow matching and continuous-time consistency models with a fused JVP attention."""

__version__ = "0.1.0"
