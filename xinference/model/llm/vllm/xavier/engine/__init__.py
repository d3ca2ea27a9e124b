"""The engine's KV cache as Xavier sees it: its layout (``layout.py``), whole blocks
as rows of bytes (``blocks.py``), and the device idioms for sharing it between
processes (``device.py``)."""
