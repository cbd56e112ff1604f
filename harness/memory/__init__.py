"""Memory of the capture path: the live-storage / CUDA-peak tracker, the capture paths
it measures (list + cat against the packer), and the ``bench`` verb."""
