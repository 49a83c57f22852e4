from keyexpiry.cli import main

main()
