"""The RL objective: advantages, the PPO clip loss, IS correction, clip methods, Calibrated Clipping."""
