"""Running catalog processes on the local machine: shared by the broker's process operator and the agent."""
