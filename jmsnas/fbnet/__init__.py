"""The FBNet search space (HW-NAS-Bench's CIFAR-100 macro-architecture): layout, blocks, HELP's data, search."""
