from crossroads.cli import main

main()
