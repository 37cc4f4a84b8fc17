"""What a run shows and asks on the terminal: the banner, the staged exit prompt, the review text."""
