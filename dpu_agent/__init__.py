"""dpu_agent: the context-memory tier's agent (runs on BlueField Arm cores, or any Linux box)."""

__version__ = "0.1.0"
