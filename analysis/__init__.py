"""Analysis: reads run directories only and regenerates the paper's figures and tables."""
