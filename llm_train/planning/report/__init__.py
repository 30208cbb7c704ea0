"""What `llm-train plan --recipe NAME` prints: the verdict, the fixes and notes under the estimate."""
