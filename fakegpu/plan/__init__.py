"""Planning a cluster job (issue 31): modeled GPU time of the ops a rank runs.

So far: per-GPU compute figures (:mod:`.gpu_compute`, a view of the catalogue's profiles), a
modeled time per aten op (:mod:`.compute`) and a recorder of the ops of a region run on fake
tensors (:mod:`.capture`).  Streams, overlap, the `fgpu plan` command and calibration come next
(docs/planning.md)."""
