"""The seed's device-tier transport: persistent slabs moved with ``xo.copy_to``
(``gpu_transfer.GPUTransfer``), the slab choice per source rank
(``slab_selector.SlabSelector``), and the seam's adapter (``transport.py``)."""
