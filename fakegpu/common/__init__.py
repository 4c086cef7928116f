"""Types that several parts of fakegpu share (the coordinator, fake worlds, reports): records of
communicators and operations, NCCL datatypes."""
