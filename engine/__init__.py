"""holdfast reference engine: a Llama-family model attached to the weight cache, over HTTP.

Importing this package does not import torch; `engine.cli` does, once startup is timed.
"""

__version__ = "0.1.0"
