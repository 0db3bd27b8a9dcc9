from transportd.cli import main

main()
