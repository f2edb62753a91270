"""holdfast supervisor: an asyncio control plane over cache daemons and a crew of engines.

Imports no torch and never creates a CUDA context.
"""

__version__ = "0.1.0"
