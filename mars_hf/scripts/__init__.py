"""Training scripts shipped inside the package (like ``trl/scripts``), so ``mars-hf train`` works from any install."""
