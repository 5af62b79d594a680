"""The words about figures: what the dashboard and summary.md say of them."""
