"""Op interfaces that model code is written against; a selected backend sits behind each."""
