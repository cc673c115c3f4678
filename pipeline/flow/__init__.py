"""The declarative pipeline: typed specs (`spec.py`) and the one stage table (`stages.py`)."""
