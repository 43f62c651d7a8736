"""fastdpo: fast, memory-lean Direct Preference Optimization on a packed, prefix-shared pair layout."""

__version__ = "0.1.0"
