"""Small helpers shared by the layers (thread sizing, heap release, identity caches, the native kernels' loader)."""
