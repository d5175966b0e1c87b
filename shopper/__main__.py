from shopper.cli import main

main()
