"""`invoke bench`: what users feel, measured as ratios against baselines of the same run."""
