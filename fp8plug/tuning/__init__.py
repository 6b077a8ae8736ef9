"""What the device can do, and the cost model that keeps slow layers in high precision."""
