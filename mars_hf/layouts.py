"""What a MARS step feeds and where its predictions sit. Being written (issue 10)."""
