"""Sample quality: FID (flm.metrics.fid), the label accuracy of a small MNIST classifier
(flm.metrics.classifier) and the share of faint pixels (flm.metrics.pixels). All take images as generators
return them ([-1, 1], (N, C, H, W)) or as sample.py's .npz stores them (uint8, (N, H, W, C))."""
