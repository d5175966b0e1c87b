from shopper.cli import app

app()
